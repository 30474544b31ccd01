"""Host expert bank, the shared device expert cache, the paged KV pool and the prefix tree."""
