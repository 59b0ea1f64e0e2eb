"""What the user writes: the option schema, parsing of the command line and run TOML, the dataset config."""
