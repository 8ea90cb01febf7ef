"""The `dlfs` command: parsing, one module per command family, mount/umount, doctor, demo."""
