"""The internode path: dispatch and combine across nodes (rail transport, then the node's intranode engine)."""
