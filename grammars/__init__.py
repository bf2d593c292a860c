"""The grammar engine that plugs into the core's constraint protocols."""
