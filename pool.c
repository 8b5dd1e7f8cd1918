/* pool.c */
#include "strata.h"
