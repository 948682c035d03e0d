"""specmesh cluster role."""
