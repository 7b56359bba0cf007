"""Run configuration: frozen dataclasses with defaults that work, and their validation.

tyro turns `TrainConfig` into the CLI, so every field here is a flag (`--model.d-model 384`). Values are
checked when a config is built, so a bad flag fails before any data is read or any array is allocated.
Fields that a resumed run may change are marked where they are declared (`resume_safe`);
`codec.config_changes` reports every other difference.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from minigpt.config.lora import LoRAConfig
from minigpt.errors import ConfigError, check  # a leaf module, so optimizer.py can raise it too
from minigpt.files import user_cache_dir
from minigpt.optimizer import AdamW, CosineDecaySchedule, Optimizer, Schedule

_RESUME_SAFE = "minigpt.resume_safe"


def resume_safe(default: Any) -> Any:
    """Declare a config field a resumed run may change (bookkeeping, run length, device layout): a dataclass
    field with this default. Unmarked fields are unsafe: changing one on resume is refused by
    `config_changes`, since it would silently change the run."""
    return dataclasses.field(default=default, metadata={_RESUME_SAFE: True})


def is_resume_safe(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get(_RESUME_SAFE, False))


REMAT_POLICIES = ("none", "dots", "projections", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape. `vocab_size=0` takes the tokenizer's vocabulary."""

    vocab_size: int = 0
    max_seq_len: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    d_ff: int = 1024
    dropout: float = 0.0
    """Dropout on embeddings and each residual branch while training (rounded to a multiple of 2^-16)."""
    norm_position: Literal["pre", "post"] = "pre"
    """pre: GPT-2 style, norm before each sublayer; post: norm after the residual add (the original
    Transformer's and the Flax miniGPT tutorial's blocks)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    position: Literal["learned", "rope"] = "learned"
    """learned: a table of max_seq_len position vectors (GPT-2); rope: rotary embeddings in attention."""
    rope_theta: float = 10_000.0
    rope_scaling: Literal["none", "llama3"] = "none"
    """llama3: Llama 3.1's RoPE frequency scaling (low frequencies divided by rope_factor, high ones kept,
    those between interpolated), for checkpoints trained with it."""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    """The llama3 scaling's parameters (transformers' rope_parameters: factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings)."""
    activation: Literal["gelu", "relu", "relu2", "swiglu"] = "gelu"
    """MLP non-linearity; swiglu adds a gate matrix (keep d_ff ~ 8/3 d_model for the same size as 4 d_model)."""
    qk_norm: bool = False
    """RMS-normalise queries and keys per head before attention: bounds the attention logits."""
    value_residual: bool = False
    """Mix the first layer's attention values into every later layer's, in a learned share per layer
    (ResFormer's value residual). No transformers class computes it: such a model does not export."""
    value_embeddings: int = 0
    """Tables of per-token value vectors (modded-nanogpt's value embeddings): layer i adds its token's vector
    from table i mod n to its attention values, in a learned share. 0: none. No transformers class computes
    them: such a model does not export."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention (0: n_heads, i.e. plain multi-head attention)."""
    head_dim: int = 0
    """Width of each attention head (0: d_model / n_heads); queries are n_heads x head_dim wide."""
    tie_embeddings: bool = False
    bias: bool = True
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2's); `bias` puts them everywhere."""
    norm_eps: float = 1e-5
    """The epsilon every norm (QK-norm too) adds to the variance."""
    scaled_init: bool = True
    """Initialise residual projections (attention output, MLP down) with std 0.02/sqrt(2 n_layers)."""
    dtype: Literal["auto", "float32", "bfloat16"] = resume_safe("float32")
    """Compute dtype; parameters and optimizer state stay float32. bfloat16 multiplies bfloat16 operands with
    float32 accumulation and keeps norms, softmax and the loss in float32. auto: bfloat16 on accelerators,
    and on a CPU where a dense layer trains faster in it (matrix units such as AMX or AVX-512 BF16: measured
    once per machine), float32 elsewhere; every preset's default."""
    attention: Literal["auto", "xla", "cudnn", "mixed"] = "auto"
    """xla, cudnn: jax.nn.dot_product_attention's implementations; mixed: minigpt's, bfloat16 products with
    float32 accumulation laid out for the CPU's matrix units. auto: cudnn on GPUs and mixed elsewhere in
    bfloat16, xla in float32."""
    remat: Literal["none", "dots", "projections", "full"] = resume_safe("none")
    """What each layer keeps for the backward pass; the rest is recomputed there (less memory, more compute).
    none: everything; dots: every matmul's output (elementwise work is recomputed); projections: the
    outputs of the weight matmuls but nothing inside attention (scores and probabilities are recomputed);
    full: only the layer's input. With --model.scan-layers the backward pass recomputes layer by layer; with
    unrolled layers XLA's CPU scheduler may recompute early and save little."""
    loss_chunk: int = resume_safe(-1)
    """Sequence positions per chunk of the output layer's loss and gradients, so the batch x sequence x vocab
    logits never exist at once (0: all at once; -1: the power of two nearest 2^24 logits per chunk)."""
    scan_layers: bool = False
    """Stack the layers' parameters and run them with lax.scan: compile time stays flat with depth."""
    document_attention: bool = False
    """Attention stays inside a document of a packed window and positions restart at each document: a
    document's end-of-text token starts the next one (at position 0), so every document is modelled as if it
    began its window, as in generation and task evaluation."""
    eot_id: int = -1
    """The end-of-text token that separates documents (-1: the tokenizer's)."""
    vocab_multiple: int = 128
    """The embedding/output tables are padded to a multiple of this (padded logits are masked), so any
    tensor-parallel size divides the vocabulary and matmuls stay aligned."""
    lora: Annotated[LoRAConfig, tyro.conf.arg(name="lora", prefix_name=False)] = LoRAConfig()

    def __post_init__(self) -> None:
        check(
            self.vocab_size >= 0, f"model.vocab_size must be >= 0 (0 = from tokenizer), got {self.vocab_size}"
        )
        check(
            self.remat in REMAT_POLICIES,
            f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}",
        )
        check(
            self.eot_id >= -1, f"model.eot_id must be a token id or -1 (the tokenizer's), got {self.eot_id}"
        )
        check(self.loss_chunk >= -1, f"model.loss_chunk must be >= 0 or -1 (auto), got {self.loss_chunk}")
        for name in ("max_seq_len", "d_model", "n_layers", "n_heads", "d_ff", "vocab_multiple"):
            check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        check(
            self.head_dim > 0 or self.d_model % self.n_heads == 0,
            f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads} (or set "
            "model.head_dim)",
        )
        check(self.head_dim >= 0, f"model.head_dim must be >= 0 (0: d_model / n_heads), got {self.head_dim}")
        check(0 < self.norm_eps < 1, f"model.norm_eps must be in (0, 1), got {self.norm_eps}")
        for name in ("rope_factor", "rope_low_freq_factor", "rope_original_max_len"):
            check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        check(
            self.rope_high_freq_factor > self.rope_low_freq_factor,
            "model.rope_high_freq_factor must be larger than model.rope_low_freq_factor",
        )
        check(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        check(self.n_kv_heads >= 0, f"model.n_kv_heads must be >= 0, got {self.n_kv_heads}")
        check(
            self.value_embeddings >= 0,
            f"model.value_embeddings must be >= 0 (0: none), got {self.value_embeddings}",
        )
        check(
            self.n_heads % self.kv_heads == 0,
            f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}",
        )
        check(
            self.position != "rope" or self.head_size % 2 == 0,
            f"RoPE needs an even head dimension, got {self.head_size}",
        )
        check(self.rope_theta > 0, f"model.rope_theta must be positive, got {self.rope_theta}")
        check(
            "gate" not in self.lora.targets or self.activation == "swiglu",
            f"lora.targets names gate, but this model's MLP has no gate projection ({self.activation}, not "
            "swiglu); leave it out",
        )

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple


_NAMED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)=(?P<rest>.+)")
_WEIGHT = re.compile(
    r"(?P<path>.+):(?P<weight>[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[-+]?[0-9]+)?|nan|inf(?:inity)?))", re.I
)  # anything a user may have meant as a number, so a bad weight is named as one, not as a missing path


def _named(item: str) -> re.Match | None:
    """NAME=PATH's parts, unless `item` is an existing file or folder: a real `k=v.txt` is a path."""
    return None if Path(item).expanduser().exists() else _NAMED.fullmatch(item)


@dataclasses.dataclass(frozen=True)
class Source:
    """One named source of a mixture: its training paths, mixture weight (normalised) and validation paths."""

    name: str
    paths: tuple[str, ...]
    weight: float = 1.0
    val_paths: tuple[str, ...] = ()


def _parse_named(items: tuple[str, ...], flag: str, weighted: bool) -> dict[str, tuple[str, float]] | None:
    """NAME=PATH[:WEIGHT] items as {name: (path, weight)}; None when no item is named (one plain source)."""
    named = [_named(item) for item in items]
    if not any(named):
        return None
    if not all(named):
        plain = items[named.index(None)]
        raise ConfigError(
            f"{flag} mixes named sources (NAME=PATH) with a plain path ({plain}); name every one"
        )
    out: dict[str, tuple[str, float]] = {}
    for m in named:
        path, weight = m["rest"], 1.0
        w = _WEIGHT.fullmatch(path) if weighted and not Path(path).expanduser().exists() else None
        if w is not None:
            path, weight = w["path"], float(w["weight"])
            check(
                math.isfinite(weight) and weight > 0,
                f"{flag} {m.group(0)}: the weight of source {m['name']!r} must be a finite positive number, "
                f"got {w['weight']}",
            )
        check(m["name"] not in out, f"{flag} names source {m['name']!r} twice; give each source one entry")
        out[m["name"]] = (path, weight)
    return out


def _absolute_item(item: str) -> str:
    """A --data item with its path made absolute (a source's name and weight kept; hub names as they are)."""
    m = _named(item)
    name, path = (m["name"] + "=", m["rest"]) if m else ("", item)
    return name + (path if path.startswith("hf:") else str(Path(path).expanduser().absolute()))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes tokens."""

    paths: Annotated[tuple[str, ...], tyro.conf.arg(name="data", prefix_name=False)] = ()
    """Training text: .txt, .jsonl or .parquet files, folders of them, or glob patterns ('shards/*.jsonl'), or
    a Hugging Face hub dataset, hf:OWNER/NAME[@REVISION][?config=NAME&split=SPLIT&files=GLOB] (quoted in a
    shell; its files are downloaded shard by shard as they are tokenized, see minigpt.data.hub). A mixture names
    its sources with weights: --data stories=train.txt:0.7 books=gutenberg/:0.3 (each source one path,
    folder or pattern; weight 1 if left out). Empty: TinyStories, downloaded from the hub."""
    val_paths: Annotated[tuple[str, ...], tyro.conf.arg(name="val-data", prefix_name=False)] = ()
    """Validation text (for a mixture, NAME=PATH per source); of an hf: dataset, its validation split unless
    ?split= says otherwise. Empty: hold out `val_fraction` of the training documents (or TinyStories' valid
    split); a mixture's sources without one hold out their own."""
    val_fraction: float = 0.05
    seq_len: int = 256
    """Training window length (tokens); at most model.max_seq_len."""
    tokenizer: Literal["gpt2", "bpe", "hf"] = "gpt2"
    """gpt2: tiktoken's GPT-2 BPE (50257 tokens). bpe: a byte-level BPE trained on the training text. hf: the
    tokenizer of a transformers checkpoint (--data.hf-tokenizer), with its BOS and end-of-text conventions."""
    hf_tokenizer: str | None = None
    """With --data.tokenizer hf: a transformers checkpoint folder (its tokenizer.json, tokenizer_config.json
    and config.json), or the tokenizer/ folder of a run that trained with one."""
    bpe_vocab_size: int = 4096
    gpt2_dir: str | None = resume_safe(None)
    """Folder with GPT-2's vocab.bpe + encoder.json, for offline use (else $MINIGPT_GPT2_DIR, else download)."""
    cache_dir: str = resume_safe("")
    """Where token stores are kept (in its tokens/ folder). Empty: $MINIGPT_CACHE_DIR, else
    $XDG_CACHE_HOME/minigpt, else ~/.cache/minigpt, as for the compilation cache."""
    separator: Literal["eot", "blank-line"] = "eot"
    """How .txt files separate documents: <|endoftext|> markers (TinyStories), or blank lines (paragraphs)."""
    text_field: str = "text"
    """The .jsonl field, or .parquet column, that holds each document's text."""
    encoding_errors: Literal["error", "replace"] = "error"
    """Bytes that are not UTF-8: error (stop, naming the file and byte offset), or replace with U+FFFD and warn."""
    bpe_train_bytes: int = 50_000_000
    """The BPE is trained on the first this-many bytes of training documents, so huge corpora fit in memory."""
    tokenize_workers: int = resume_safe(0)
    """Processes that tokenize in parallel. 0: one per core for corpora over 64 MB (256 MB on 2 cores, where
    starting workers costs more below that), otherwise tokenize in this process."""

    window_start: Literal["anywhere", "document"] = "anywhere"
    """Where training windows begin. anywhere: the token stream is cut into consecutive windows, every token a
    target once per epoch. document: each window begins at a document (its end-of-text token), and documents
    longer than a window go on in further windows; the text after a short document is seen again as the
    start of the next one."""
    examples: tyro.conf.Suppress[bool] = False
    """Not a flag: set when a run's data holds examples (conversations), whose tokens carry the loss mask and
    where each example starts (`minigpt.data.packing`), for the train and eval steps to take apart."""

    def __post_init__(self) -> None:
        self.sources()  # the mixture syntax, checked before any data is read
        check(
            self.window_start in ("anywhere", "document"),
            f"data.window_start must be anywhere or document, got {self.window_start!r}",
        )
        check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        check(self.seq_len > 0, f"data.seq_len must be positive, got {self.seq_len}")
        check(self.bpe_vocab_size >= 260, f"data.bpe_vocab_size must be >= 260, got {self.bpe_vocab_size}")
        check(self.bpe_train_bytes > 0, f"data.bpe_train_bytes must be positive, got {self.bpe_train_bytes}")
        check(self.tokenize_workers >= 0, f"data.tokenize_workers must be >= 0, got {self.tokenize_workers}")
        check(bool(self.text_field), "data.text_field must name a field")
        check(
            (self.tokenizer == "hf") == bool(self.hf_tokenizer),
            "--data.tokenizer hf and --data.hf-tokenizer FOLDER go together: name the checkpoint folder whose "
            "tokenizer to use",
        )

    def sources(self) -> tuple[Source, ...]:
        """The training sources: one unnamed source of every path, or the named sources of a mixture with
        their weights normalised to sum to 1."""
        named = _parse_named(self.paths, "--data", weighted=True)
        val = _parse_named(self.val_paths, "--val-data", weighted=False)
        if named is None:
            check(val is None, "--val-data names sources (NAME=PATH), but --data is not a mixture")
            return (Source("", self.paths, 1.0, self.val_paths),)
        check(
            val is not None or not self.val_paths, "a mixture's --val-data must name its sources: NAME=PATH"
        )
        unknown = sorted(set(val or {}) - set(named))
        check(not unknown, f"--val-data names {unknown[0] if unknown else ''!r}, which is no --data source")
        total = sum(w for _, w in named.values())
        check(math.isfinite(total), "--data: the mixture's weights sum past the largest float; use smaller")
        return tuple(
            Source(n, (p,), w / total, ((val[n][0],) if val and n in val else ()))
            for n, (p, w) in named.items()
        )

    def cache(self) -> Path:
        """The folder token stores are kept under (in its tokens/ folder)."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else user_cache_dir()

    def absolute(self) -> DataConfig:
        """The same data with every path absolute, so a run directory's config reads the same files (and token
        cache) from any working directory."""
        absolute = lambda p: str(Path(p).expanduser().absolute())
        return dataclasses.replace(
            self,
            paths=tuple(_absolute_item(p) for p in self.paths),
            val_paths=tuple(_absolute_item(p) for p in self.val_paths),
            cache_dir=str(self.cache().absolute()),
            gpt2_dir=None if self.gpt2_dir is None else absolute(self.gpt2_dir),
            hf_tokenizer=None if self.hf_tokenizer is None else absolute(self.hf_tokenizer),
        )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: data parallel x FSDP x tensor parallel. One size may be -1 for 'all remaining devices'."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    fsdp_min_mbytes: float = 4.0
    """Arrays smaller than this stay replicated under FSDP: sharding them costs more than it saves."""
    cpu_devices: int = -1
    """XLA devices to split a CPU into when training (1: one; -1: one per core, as many as the mesh and batch
    allow, unless $XLA_FLAGS sets --xla_force_host_platform_device_count or the run has several processes).
    An accelerator's devices are not affected."""

    def __post_init__(self) -> None:
        check(
            self.cpu_devices == -1 or self.cpu_devices >= 1,
            f"mesh.cpu_devices must be >= 1 or -1 (one per core), got {self.cpu_devices}",
        )
        sizes = (self.data, self.fsdp, self.tensor)
        check(all(s == -1 or s >= 1 for s in sizes), f"mesh sizes must be >= 1 or -1, got {sizes}")
        check(sizes.count(-1) <= 1, f"at most one mesh size may be -1, got {sizes}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process (multi-host) start-up through `jax.distributed`. Unset: a single process.

    Each value falls back to $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and $JAX_PROCESS_ID."""

    coordinator: str | None = None
    """host:port of process 0, which serves the coordination service."""
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    """Let JAX detect the cluster instead (Cloud TPU pods, SLURM, Open MPI, Kubernetes)."""
    timeout_s: int = 120
    """How long to wait for all processes to reach the coordinator."""

    def __post_init__(self) -> None:
        check(self.timeout_s > 0, f"dist.timeout_s must be positive, got {self.timeout_s}")
        if self.num_processes is not None:
            check(self.num_processes >= 1, f"dist.num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None:
            check(
                0 <= self.process_id < self.num_processes,
                f"dist.process_id={self.process_id} must be in [0, {self.num_processes})",
            )


WANDB_MODES = ("online", "offline", "disabled")
_WANDB_PROJECT_BAD = "/\\#?%:"  # characters W&B refuses in a project name


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases tracking beside metrics.jsonl and TensorBoard (`pip install 'minigpt[wandb]'`): off
    unless a project is named. Only process 0 logs; the run's W&B id is kept in run_dir/wandb, so a resumed
    run continues the same W&B run."""

    project: str = ""
    """The W&B project to log every metric to; empty: no W&B run."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online: stream to the W&B server (after `wandb login`); offline: write it to run_dir/wandb only, for
    `wandb sync` to upload later; disabled: no W&B run, even with a project."""
    entity: str | None = None
    """The W&B user or team that owns the project; None: your W&B account's default entity."""
    name: str | None = None
    """The W&B run's display name; None: the run directory's name."""
    tags: tuple[str, ...] = ()
    """Tags for the W&B run (--wandb.tags baseline muon)."""

    def __post_init__(self) -> None:
        check(
            self.mode in WANDB_MODES,
            f"wandb.mode must be one of {', '.join(WANDB_MODES)}, got {self.mode!r}",
        )
        for name in ("entity", "name", "tags"):
            check(
                bool(self.project) or not getattr(self, name),
                f"wandb.{name} is set but wandb.project is empty; name the project: --wandb.project NAME",
            )
        check(
            len(self.project) <= 128 and not any(c in _WANDB_PROJECT_BAD for c in self.project),
            f"wandb.project {self.project!r} must be at most 128 characters without any of "
            f"{' '.join(_WANDB_PROJECT_BAD)}; give a team with --wandb.entity, not as part of the project",
        )
        for name in ("entity", "name"):
            check(
                getattr(self, name) != "", f"wandb.{name} is empty; leave --wandb.{name} out for the default"
            )
        for tag in self.tags:
            check(0 < len(tag) <= 64, f"wandb.tags: {tag!r} must be 1 to 64 characters long (W&B's limit)")

    @property
    def enabled(self) -> bool:
        """Whether a run logs to W&B: a project is named and the mode is not disabled."""
        return bool(self.project) and self.mode != "disabled"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs. `minigpt train --preset cpu --steps 500 --run-dir runs/a`."""

    run_dir: str = resume_safe("runs/default")
    """Where config, metrics, plots and checkpoints go; training there again resumes from the newest checkpoint."""
    overwrite: bool = resume_safe(False)
    """Start from scratch, deleting the run directory's checkpoints, metrics and samples."""
    init_from: str | None = None
    """Start from these weights rather than random ones: a transformers checkpoint folder (its model and
    tokenizer are the run's) or a minigpt run directory (its newest checkpoint). The run's own model flags keep
    only how it computes (dtype, attention, remat, scan, loss chunk, dropout); the default preset is then
    finetune."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = resume_safe(MeshConfig())
    dist: DistributedConfig = resume_safe(DistributedConfig())
    optimizer: Optimizer = AdamW(weight_decay=0.1)
    schedule: Schedule = CosineDecaySchedule(warmup_steps=100, peak_lr=1e-3, decay_lr=1e-4)
    """The learning-rate schedule; one whose length is 0 (the default) ends with the run, at --steps or at the
    step --max-time lays out."""
    steps: int = resume_safe(2000)
    """The run's length in optimizer steps (with --max-time: at most this many)."""
    batch_size: int = 32
    """Global batch size in sequences, split over the mesh's data and FSDP axes."""
    grad_accum: int | Literal["auto"] = 1
    """Micro-batches per optimizer update; each micro-batch has batch_size sequences. auto: batch_size is the
    sequences per update, split into the fewest micro-batches that fit the devices' memory by `minigpt plan`
    (resolved to ints when training starts, and saved as such)."""
    seed: int = 0
    max_time: float = resume_safe(0.0)
    """A training-time budget in seconds, not counting evaluation and saving (0: none; a finite number, so not
    inf). The step time is measured over the first steps and the run's length fixed then (at most --steps), so
    the schedule ends fully decayed when the budget does; the length is saved with each checkpoint, and a
    resumed run keeps it."""
    max_epochs: float = resume_safe(3.0)
    """With --max-time: the run ends by the time it has read its training text this many times, however long
    the budget (its schedule decays to that end), since repeating a small corpus more often makes the model
    worse, the sooner the weaker its weight decay (--weight-decay-passes); 0: no limit. A corpus tokenized
    only as far as the run reads never binds it."""
    weight_decay_passes: float = 0.0
    """A run from scratch raises its optimizer's weight decay to at least 1 / (peak lr x the steps of this
    many passes over the training text): what the weights learn fades within that many passes, so a small
    corpus read again and again is not memorised (0: the optimizer's weight decay alone)."""
    average_weights: float = resume_safe(0.0)
    """Keep an average of the weights over this last fraction of the run's steps, each step weighted by its
    number in it (later ones more), and end with it where it evaluates better than the last weights (0: off)."""
    log_every: int = resume_safe(10)
    eval_every: int = resume_safe(200)
    """Evaluate (and print a sample) every this many steps; 0: only at the end of the run."""
    eval_batches: int = resume_safe(0)
    """Cap on validation batches per evaluation (0: the whole validation split, deterministically)."""
    eval_tasks: tuple[str, ...] = resume_safe(())
    """lm-evaluation-harness tasks to score during training, comma- or space-separated (e.g. hellaswag
    lambada_openai; `pip install -e '.[eval]'`): their metrics go to metrics.jsonl, TensorBoard and the plot."""
    eval_tasks_every: int = resume_safe(0)
    """Score --eval-tasks every this many steps; 0: only at the end of the run."""
    eval_tasks_limit: float = resume_safe(0.0)
    """Examples per task at each scoring: a count, or a fraction below 1 (0: all of them)."""
    eval_tasks_include_path: str | None = resume_safe(None)
    """A folder of your own lm-eval task YAML files, for --eval-tasks to name."""
    ckpt_every: int = resume_safe(500)
    """Save a checkpoint every this many steps; 0: only at the end (and when stopped by a signal)."""
    keep_checkpoints: int = resume_safe(3)
    sample_prompt: str = resume_safe("")
    """What the samples printed at each evaluation continue; empty: the opening words of a validation document."""
    sample_tokens: int = resume_safe(120)
    """Tokens of the sample printed at each evaluation; 0: no samples."""
    profile_steps: str = resume_safe("")
    """Trace steps START:END (0-based, END excluded) with jax.profiler into run_dir/tb, for TensorBoard's
    profile plugin or XProf (e.g. 10:15). Empty: no trace."""
    peak_tflops: float = resume_safe(0.0)
    """Peak TFLOP/s per device for the MFU in the log (0: known accelerators' vendor figure; CPUs: measured)."""
    wandb: WandbConfig = resume_safe(WandbConfig())
    """Optional Weights & Biases tracking (--wandb.project NAME); may change when a run is resumed."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "log_every"):
            check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        for name in ("eval_every", "ckpt_every"):
            check(
                getattr(self, name) >= 0,
                f"{name} must be >= 0 (0: only at the end), got {getattr(self, name)}",
            )
        check(
            self.grad_accum == "auto" or (isinstance(self.grad_accum, int) and self.grad_accum > 0),
            f"grad_accum must be positive or 'auto', got {self.grad_accum!r}",
        )
        check(self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        check(
            math.isfinite(self.max_time) and self.max_time >= 0,
            f"max_time must be a number of seconds >= 0 (0: no budget), got {self.max_time}",
        )
        check(
            math.isfinite(self.max_epochs) and self.max_epochs >= 0,
            f"max_epochs must be a number of passes over the training text >= 0 (0: no limit), got {self.max_epochs}",
        )
        check(
            math.isfinite(self.weight_decay_passes) and self.weight_decay_passes >= 0,
            f"weight_decay_passes must be a number of passes >= 0 (0: off), got {self.weight_decay_passes}",
        )
        check(
            0 <= self.average_weights < 1,
            f"average_weights must be a fraction of the run in [0, 1) (0: off), got {self.average_weights}",
        )
        check(self.eval_batches >= 0, f"eval_batches must be >= 0, got {self.eval_batches}")
        check(
            self.sample_tokens >= 0, f"sample_tokens must be >= 0 (0: no samples), got {self.sample_tokens}"
        )
        object.__setattr__(self, "eval_tasks", split_names(self.eval_tasks))
        check(
            self.eval_tasks_every >= 0,
            f"eval_tasks_every must be >= 0 (0: only at the end), got {self.eval_tasks_every}",
        )
        check(
            self.eval_tasks_limit >= 0,
            f"eval_tasks_limit must be >= 0 (a count, a fraction below 1, or 0 for all), got {self.eval_tasks_limit}",
        )
        check(self.peak_tflops >= 0, f"peak_tflops must be >= 0, got {self.peak_tflops}")
        parse_steps_window(self.profile_steps)
        check(
            self.data.seq_len <= self.model.max_seq_len
            or bool(self.init_from),  # the source's context caps it
            f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
            "lower --data.seq-len or raise --model.max-seq-len",
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer update trains on: batch_size x grad_accum windows of seq_len targets."""
        if self.grad_accum == "auto":  # only `plan.resolve_grad_accum` knows the split
            raise ConfigError(
                "grad_accum 'auto' must be resolved (plan.resolve_grad_accum) before it is used"
            )
        return self.batch_size * self.grad_accum * self.data.seq_len

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """The steps `profile_steps` names, as (start, end), or None for no trace."""
        return parse_steps_window(self.profile_steps)


def parse_steps_window(text: str) -> tuple[int, int] | None:
    """'10:15' -> (10, 15): the steps with 0-based index 10..14 (half-open, like a Python slice); '' -> None."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    check(
        bool(sep) and start.strip().isdigit() and end.strip().isdigit() and int(start) < int(end),
        f"profile_steps must be START:END with 0 <= START < END, got {text!r}",
    )
    return int(start), int(end)


def split_names(items: tuple[str, ...]) -> tuple[str, ...]:
    """Names given comma- or space-separated (`--tasks a,b c` -> ('a', 'b', 'c')), empty ones dropped."""
    return tuple(name for item in items for name in item.split(",") if name)
