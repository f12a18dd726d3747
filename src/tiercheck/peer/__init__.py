"""The peer-memory daemon that keeps other nodes' blobs in this node's memory."""
