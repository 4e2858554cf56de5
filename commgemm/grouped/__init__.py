"""Grouped GEMMs for mixture-of-experts: the local grouped GEMM (`local`), its collective forms
for tensor-parallel experts (`collective`) and expert parallelism's dispatch and return
(`expert_parallel`)."""
