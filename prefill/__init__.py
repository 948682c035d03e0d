"""specmesh prefill role."""
