"""Small dependency-free helpers shared across the server (upstream's ``srt/utils``)."""
