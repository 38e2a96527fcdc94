"""What the worker actors share: their base (an engine on its serving loop), options, and
the messages they return to the router."""
