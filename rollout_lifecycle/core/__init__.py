"""The lifecycle core: states, the ledger, phases and the server that runs them."""
