"""The file backend: one file per page under a directory, the embedded default."""
