"""Reference models (DeepSeek-V4 style and generic hybrid SWA) in torch: weights, per-layer
math, compressors and the naive oracle forward. CPU and CUDA share one code path."""
