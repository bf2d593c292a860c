"""The server's settings, state and stores."""
