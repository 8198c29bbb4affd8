"""Scripts that run an official implementation on fixed inputs and record its outputs as a test fixture (not run
in CI: they need the official checkout and its dependencies)."""
