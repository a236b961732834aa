"""The systemd units: their names, their text (one text for NixOS and other hosts) and the
install."""
