"""mmctl's exit codes (documented in the README), and the one for each error code of the
admin API: shared by the CLI and by `mmctl up`'s service process, which exits with them too."""

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_NOT_FOUND, EXIT_CAPACITY, EXIT_LOAD_FAILED, EXIT_TIMEOUT, EXIT_UNHEALTHY = 4, 5, 6, 7, 8
EXIT_BY_ERROR = {
    "invalid_input": EXIT_USAGE,
    "invalid_model_name": EXIT_USAGE,
    "model_not_found": EXIT_NOT_FOUND,
    "capacity_exhausted": EXIT_CAPACITY,
    "load_failed": EXIT_LOAD_FAILED,
    "triton_unavailable": EXIT_UNREACHABLE,
    "timeout": EXIT_TIMEOUT,
    # The admin API refused the caller (token, Host, Origin, content type): fix the call.
    "unauthorized": EXIT_USAGE,
    "forbidden": EXIT_USAGE,
    "unsupported_media_type": EXIT_USAGE,
}
