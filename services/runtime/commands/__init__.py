"""What every `kb` command shares: settings and errors at the command line, shared options, and
`kb migrate`.
"""
