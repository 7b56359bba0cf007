"""Using a trained model: sampling with a KV cache, log-likelihoods and bits per byte, the lm-eval backend."""
