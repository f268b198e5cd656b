"""The files dapple reads and writes: text read as UTF-8 or refused in one line
(:mod:`~dapple.files.text_file`), files written whole or not at all
(:mod:`~dapple.files.atomic_file`), output paths checked before any work
(:mod:`~dapple.files.output_path`) and typed TOML configuration files
(:mod:`~dapple.files.config_file`). Torch-free."""
