"""specmesh drafter role."""
