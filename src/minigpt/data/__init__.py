"""The data layer: text -> tokens -> a token store -> Grain windows (tokenizer, corpus, hub, store, loader, mixture)."""
