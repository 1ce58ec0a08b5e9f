import { LoggerService } from '@nestjs/common';
import { pino, DestinationStream, Logger as Pino, LevelWithSilent } from 'pino';

/** The process's one pino logger: JSON lines on stdout, each with its level's name (`"level":"warn"`), not pino's number. */
export function createPino(level: string, destination?: DestinationStream): Pino {
  const options = { level: level as LevelWithSilent, formatters: { level: (label: string) => ({ level: label }) } };
  return destination ? pino(options, destination) : pino(options);
}

/**
 * Nest's logger on top of pino: `{"level":"info","time":…,"context":"SweeperService","msg":"…"}`. Request
 * lines and error lines carry the request id (`reqId`); no per-request async context is kept, which
 * would cost every promise of every request a hook.
 */
export class PinoLoggerService implements LoggerService {
  constructor(readonly pino: Pino) {}

  log(message: unknown, ...params: unknown[]): void {
    this.write('info', message, params);
  }

  error(message: unknown, ...params: unknown[]): void {
    // Nest passes (message, stack?, context?).
    const context = params.length > 0 && typeof params[params.length - 1] === 'string' ? (params.pop() as string) : undefined;
    const stack = typeof params[0] === 'string' ? params[0] : undefined;
    if (message instanceof Error) this.pino.error({ context, err: message }, message.message);
    else if (typeof message === 'object' && message !== null) this.pino.error({ context, ...message, ...(stack ? { stack } : {}) });
    else this.pino.error({ context, ...(stack ? { stack } : {}) }, String(message));
  }

  warn(message: unknown, ...params: unknown[]): void {
    this.write('warn', message, params);
  }

  debug(message: unknown, ...params: unknown[]): void {
    this.write('debug', message, params);
  }

  verbose(message: unknown, ...params: unknown[]): void {
    this.write('trace', message, params);
  }

  fatal(message: unknown, ...params: unknown[]): void {
    this.write('fatal', message, params);
  }

  private write(level: 'info' | 'warn' | 'debug' | 'trace' | 'fatal', message: unknown, params: unknown[]): void {
    if (!this.pino.isLevelEnabled(level)) return;
    const context = typeof params[params.length - 1] === 'string' ? (params[params.length - 1] as string) : undefined;
    if (typeof message === 'object' && message !== null) this.pino[level]({ context, ...message });
    else this.pino[level]({ context }, String(message));
  }
}
