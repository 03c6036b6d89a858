"""One module per `zerotrain` subcommand: add_arguments(parser) and run(args) -> exit code."""
