"""Command-line interface: each subcommand module maps flags onto one library function."""
