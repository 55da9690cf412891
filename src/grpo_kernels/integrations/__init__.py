"""Our losses inside other projects' trainers; each module is an optional extra (see pyproject.toml)."""
