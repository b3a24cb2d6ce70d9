"""The system a chaos run starts and breaks: its processes, their ports, the seeded fault
schedule and the driver that carries it out."""
