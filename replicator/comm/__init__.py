"""How processes talk: collectives, Unix-socket and peer links, agreement checks, packed point-to-point messages."""
