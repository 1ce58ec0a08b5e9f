import { ArgumentsHost, Catch, ExceptionFilter, Logger } from '@nestjs/common';
import type { FastifyReply } from 'fastify';
import { mapError } from './http-errors.js';

@Catch()
export class AllExceptionsFilter implements ExceptionFilter {
  private readonly logger = new Logger('Errors');

  catch(exception: unknown, host: ArgumentsHost): void {
    const reply = host.switchToHttp().getResponse<FastifyReply>();
    const mapped = mapError(exception);
    if (mapped.internal) this.logger.error(exception instanceof Error ? exception.stack : String(exception));
    else if (mapped.status === 503)
      this.logger.warn(`${mapped.body.error.message}: ${String((exception as { cause?: unknown }).cause ?? '')}`);
    void reply.status(mapped.status).header('content-type', 'application/json; charset=utf-8').send(mapped.body);
  }
}
