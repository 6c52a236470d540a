"""Codegen: Program -> Artifact; jinja2 templates per target (triton, cuda, hip, nki)."""
