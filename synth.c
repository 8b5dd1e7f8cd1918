/* synth.c */
#include "strata.h"
