"""How processes talk: collectives, Unix-socket links, agreement checks and packed point-to-point messages."""
