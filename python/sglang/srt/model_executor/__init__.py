"""Model runner: builds the model and the device KV pools, runs forwards, samples."""
