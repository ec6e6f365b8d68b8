"""Developer tools run by CI and by hand (not part of the kvguard package)."""
