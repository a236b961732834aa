"""The one way dspark reads a file it did not write (`safe_read`) and writes a state file
(`state_io`)."""
