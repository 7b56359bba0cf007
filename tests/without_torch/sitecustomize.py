"""Imported at start-up by the `minigpt` commands the tests run (this folder is first on their PYTHONPATH):
they then see no PyTorch, as a user who installed minigpt alone does. PyTorch is a test-only dependency (for
comparing against transformers); without this, tensorboardX imports it in every training process (seconds
each), and a command that needed it by mistake would pass here and fail for users. The path finder is
wrapped so that it finds no `torch`: `import torch` raises ModuleNotFoundError and
importlib.util.find_spec("torch") is None, exactly as when it is not installed."""

import sys
from importlib.machinery import PathFinder


class _PathFinderWithoutTorch:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):  # importlib.metadata asks the path finder for packages' metadata
        return PathFinder.find_distributions(*args, **kwargs)

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()


sys.meta_path[:] = [_PathFinderWithoutTorch if f is PathFinder else f for f in sys.meta_path]
