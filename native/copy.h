/* Bounded fd-to-fd copy: copy.c. */
#pragma once
#include <stdint.h>

int64_t sfs_copy(int in_fd, int out_fd, int64_t max_bytes);
