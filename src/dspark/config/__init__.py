"""The cluster file: its fields (schema), reading and validating it, the template, TOML, the one
type check, where the API key is read and what counts as a secret."""
