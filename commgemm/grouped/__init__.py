"""Grouped GEMMs for mixture-of-experts: the local grouped GEMM (`local`) and its collective
forms for tensor-parallel experts (`collective`)."""
