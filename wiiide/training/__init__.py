"""The training pieces every engine shares: what is trained, on what, and how it is judged.

- `models`: the models (mlp, cnn, transformer, embedding) behind one registry keyed by ``RunConfig.model``;
- `model`: flat views of a model's parameters and gradients, the optimizer step on them;
- `corpus`, `data`: the language model's corpus and every data set (real or synthetic);
- `evaluation`: held-out evaluation during training and time to target;
- `workload`: what a node records about its workload.

This package imports only the shared modules at the top of `wiiide` (config, errors, metrics, ...).
"""
