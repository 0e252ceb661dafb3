"""Where a request is sent once no cache answered it."""
