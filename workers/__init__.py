"""What the worker actors share with the router: their messages."""
