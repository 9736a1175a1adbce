/* redirect-probe [ITERATIONS]: the guest side of the vCPU redirection test (docs/platforms.md).
 *
 * Prints one line "redirect-probe pid=P fn=0x... ret=0x... site=0x... poke=0x..." (site: the
 * syscall instruction below; poke: a word vmsight may write before the call) and then makes nothing but raw getppid syscalls from checked_getppid(),
 * each with every general register holding a known pattern and the carry flag set, until
 * probe_fn has been called (by vmsight redirecting a vCPU at one of those syscalls) or
 * ITERATIONS (default 50 million) calls were made. The loop reads no clock (under TCG the
 * vDSO falls back to a clock_gettime syscall), so the process enters the kernel only through
 * that one syscall instruction.
 *
 * probe_fn(a, b, c, d, e, f) returns a + 2b + 3c + 4d + 5e + 6f + poke in rax and rdx, records
 * its arguments and the GS base it runs with (rdgsbase: vmsight may set it), and then deliberately trashes every other general register, including the
 * callee-saved ones a C function would have to keep: only vmsight's restore can put them back.
 * It keeps the arithmetic flags itself (pushfq at its entry, popfq before it returns): under
 * TCG they live in QEMU's lazy condition-code state, which the plugin API can neither read nor
 * write, so a redirected function preserves them (docs/platforms.md). It returns to probe_ret,
 * which holds the return marker (nopl 0x564d5352(%rax)) followed by ud2.
 *
 * After each syscall every register is compared with what it must be: the patterns, rsp as
 * before, rcx = the address after the syscall, r11 = the flags before it (the syscall
 * instruction stores RFLAGS in r11), rax = getppid(). The result line is
 *   "redirect-probe calls=N result=R args=A,B,C,D,E,F fngs=G gs=H regs=intact"  (exit 0), or
 * (fngs: the GS base inside the function; gs: the GS base after the redirected syscall), or
 *   "... regs=CHANGED <names>" (exit 1), or "redirect-probe calls=0 exhausted" (exit 2).
 * Built with gcc -O2 -static by guest/build-image.sh into /usr/local/bin of the guest. */
#define _GNU_SOURCE
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

volatile uint64_t calls, result, got_args[6], poke, got_gs;
uint64_t regs_after[16], flags_before, rsp_before;

uint64_t checked_getppid(void);
void probe_fn(void);
void probe_ret(void);
void after_syscall(void);

#define P(n) "0x" #n #n #n #n #n #n #n #n #n #n #n #n #n #n #n #n

__asm__(
    ".text\n"
    ".globl checked_getppid\n"
    "checked_getppid:\n"
    "  push %rbx\n  push %rbp\n  push %r12\n  push %r13\n  push %r14\n  push %r15\n"
    "  movabs $" P(1) ", %rbx\n"
    "  movabs $" P(2) ", %rbp\n"
    "  movabs $" P(3) ", %r12\n"
    "  movabs $" P(4) ", %r13\n"
    "  movabs $" P(5) ", %r14\n"
    "  movabs $" P(6) ", %r15\n"
    "  movabs $" P(7) ", %rdi\n"
    "  movabs $" P(8) ", %rsi\n"
    "  movabs $" P(9) ", %rdx\n"
    "  movabs $0xaaaaaaaaaaaaaaaa, %r10\n"
    "  movabs $0xbbbbbbbbbbbbbbbb, %r8\n"
    "  movabs $0xcccccccccccccccc, %r9\n"
    "  mov %rsp, rsp_before(%rip)\n"
    "  mov $" "110" ", %eax\n" /* getppid */
    "  stc\n"
    "  pushfq\n"
    "  pop %rcx\n"
    "  mov %rcx, flags_before(%rip)\n"
    "  movabs $0xdddddddddddddddd, %rcx\n"
    "  movabs $0xeeeeeeeeeeeeeeee, %r11\n"
    "  stc\n"
    "  syscall\n"
    ".globl after_syscall\n"
    "after_syscall:\n"
    "  mov %rax, regs_after+0(%rip)\n"
    "  mov %rbx, regs_after+8(%rip)\n"
    "  mov %rcx, regs_after+16(%rip)\n"
    "  mov %rdx, regs_after+24(%rip)\n"
    "  mov %rsi, regs_after+32(%rip)\n"
    "  mov %rdi, regs_after+40(%rip)\n"
    "  mov %rbp, regs_after+48(%rip)\n"
    "  mov %rsp, regs_after+56(%rip)\n"
    "  mov %r8, regs_after+64(%rip)\n"
    "  mov %r9, regs_after+72(%rip)\n"
    "  mov %r10, regs_after+80(%rip)\n"
    "  mov %r11, regs_after+88(%rip)\n"
    "  mov %r12, regs_after+96(%rip)\n"
    "  mov %r13, regs_after+104(%rip)\n"
    "  mov %r14, regs_after+112(%rip)\n"
    "  mov %r15, regs_after+120(%rip)\n"
    "  pop %r15\n  pop %r14\n  pop %r13\n  pop %r12\n  pop %rbp\n  pop %rbx\n"
    "  ret\n"

    ".globl probe_fn\n"
    "probe_fn:\n"
    "  pushfq\n"
    "  mov %rdi, got_args+0(%rip)\n"
    "  mov %rsi, got_args+8(%rip)\n"
    "  mov %rdx, got_args+16(%rip)\n"
    "  mov %rcx, got_args+24(%rip)\n"
    "  mov %r8, got_args+32(%rip)\n"
    "  mov %r9, got_args+40(%rip)\n"
    "  mov %rdi, %rax\n"
    "  lea (%rax,%rsi,2), %rax\n"
    "  lea (%rdx,%rdx,2), %r10\n"
    "  add %r10, %rax\n"
    "  lea (%rax,%rcx,4), %rax\n"
    "  lea (%r8,%r8,4), %r10\n"
    "  add %r10, %rax\n"
    "  imul $6, %r9, %r10\n"
    "  add %r10, %rax\n"
    "  add poke(%rip), %rax\n"
    "  rdgsbase %r10\n"
    "  mov %r10, got_gs(%rip)\n"
    "  mov %rax, result(%rip)\n"
    "  lock incq calls(%rip)\n"
    "  movabs $0x0badc0de0badc0de, %rbx\n"
    "  mov %rbx, %rcx\n  mov %rbx, %rsi\n  mov %rbx, %rdi\n  mov %rbx, %rbp\n"
    "  mov %rbx, %r8\n  mov %rbx, %r9\n  mov %rbx, %r10\n  mov %rbx, %r11\n"
    "  mov %rbx, %r12\n  mov %rbx, %r13\n  mov %rbx, %r14\n  mov %rbx, %r15\n"
    "  mov %rax, %rdx\n"
    "  clc\n"
    "  popfq\n"
    "  ret\n"

    ".globl probe_ret\n"
    "probe_ret:\n"
    "  .byte 0x0f, 0x1f, 0x80, 0x52, 0x53, 0x4d, 0x56\n" /* nopl 0x564d5352(%rax) */
    "  ud2\n");

static const char *const names[16] = {"rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp",
                                      "r8",  "r9",  "r10", "r11", "r12", "r13", "r14", "r15"};

int main(int argc, char **argv)
{
    unsigned long long limit = argc > 1 ? strtoull(argv[1], NULL, 10) : 50000000ULL;
    long ppid = syscall(SYS_getppid);
    printf("redirect-probe pid=%d fn=%#" PRIxPTR " ret=%#" PRIxPTR " site=%#" PRIxPTR
           " poke=%#" PRIxPTR "\n",
           (int)getpid(), (uintptr_t)probe_fn, (uintptr_t)probe_ret,
           (uintptr_t)after_syscall - 2, (uintptr_t)&poke);
    fflush(stdout);
    const uint64_t want[16] = {
        (uint64_t)ppid, 0x1111111111111111, (uint64_t)(uintptr_t)after_syscall, 0x9999999999999999,
        0x8888888888888888, 0x7777777777777777, 0x2222222222222222, 0,
        0xbbbbbbbbbbbbbbbb, 0xcccccccccccccccc, 0xaaaaaaaaaaaaaaaa, 0,
        0x3333333333333333, 0x4444444444444444, 0x5555555555555555, 0x6666666666666666,
    };
    char changed[512] = "";
    for (unsigned long long it = 0; calls == 0 && it < limit; it++) {
        checked_getppid();
        uint64_t w[16];
        for (int i = 0; i < 16; i++)
            w[i] = want[i];
        w[7] = rsp_before;
        w[11] = flags_before;
        for (int i = 0; i < 16; i++) {
            if (regs_after[i] != w[i]) {
                size_t n = 0;
                while (changed[n])
                    n++;
                snprintf(changed + n, sizeof changed - n, " %s=%#" PRIx64 "(want %#" PRIx64 ")",
                         names[i], regs_after[i], w[i]);
            }
        }
        if (changed[0])
            break;
    }
    if (calls == 0 && !changed[0]) {
        printf("redirect-probe calls=0 exhausted\n");
        return 2;
    }
    uint64_t gs;
    __asm__ volatile("rdgsbase %0" : "=r"(gs));
    printf("redirect-probe calls=%" PRIu64 " result=%#" PRIx64 " args=%#" PRIx64 ",%#" PRIx64
           ",%#" PRIx64 ",%#" PRIx64 ",%#" PRIx64 ",%#" PRIx64 " fngs=%#" PRIx64 " gs=%#" PRIx64
           " regs=%s%s\n",
           calls, result, got_args[0], got_args[1], got_args[2], got_args[3], got_args[4],
           got_args[5], got_gs, gs, changed[0] ? "CHANGED" : "intact", changed);
    return changed[0] ? 1 : 0;
}
