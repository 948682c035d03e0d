"""The benchmark harness behind ``specmesh bench``: served, in-process and Hugging Face systems
run interleaved on the same prompts, with the report, tables and plot."""
