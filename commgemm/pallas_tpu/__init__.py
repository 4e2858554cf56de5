"""Fused TPU kernels (Pallas TPU, remote DMA): ring collectives (`ring`) and collective GEMMs
(`gemm`), wired into the ops by `ops`; on a TPU, or in Pallas' TPU interpret mode on any
backend with `OverlapConfig(atomic_gemm=True, interpret=True)`."""
