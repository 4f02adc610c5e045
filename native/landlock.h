/* The Landlock syscalls (ruleset, path and port rules): landlock.c. */
#pragma once
#include <stdint.h>

int sfs_landlock_abi(void);
int sfs_landlock_create(uint64_t fs, uint64_t net, uint64_t scoped);
int sfs_landlock_add_path(int ruleset_fd, int parent_fd, uint64_t access);
int sfs_landlock_add_port(int ruleset_fd, uint64_t port, uint64_t access);
