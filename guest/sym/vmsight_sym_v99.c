// SPDX-License-Identifier: GPL-2.0
/* vmsight_sym built for interface version 99 (Kbuild sets -DVSYM_MODULE_ABI=99). */
#include "vmsight_sym.c"
