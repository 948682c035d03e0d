"""specmesh decode role."""
