"""The HTTP edge: routes translate requests into scheduler calls and relay backend responses."""
