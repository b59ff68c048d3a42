"""The `voicechat` command and its subcommands (generate, synth, cache-prompt, serve, client,
talk; parity and bench dispatch to the harness and bench packages, installed with their extra)."""
