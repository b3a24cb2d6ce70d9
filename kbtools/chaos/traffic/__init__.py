"""What a chaos run sends to the system it runs: the load (publishes, new versions, deletes
and erases, by HTTP and by event, with poisons among the commands) and the searches."""
