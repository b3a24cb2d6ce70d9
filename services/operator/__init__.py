"""The operator page: server-rendered HTML at ``/ui`` over every service's tables."""
