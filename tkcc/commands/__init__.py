"""CLI subcommands that span several packages (compile, passes, golden)."""
