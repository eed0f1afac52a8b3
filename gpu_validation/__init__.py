"""GPU validation: the RFC §7.2 numerics and KV-isolation harness for any set of SGLang engines, and the
bucketed-transfer benchmark. Nothing here imports `versioned_lora.runtime`: the harness takes engine URLs
and reports, so it runs unchanged against CPU engines here and CUDA engines on a cluster."""
