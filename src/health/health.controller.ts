import { Controller, Get } from '@nestjs/common';
import { ApiExtraModels, ApiOperation, ApiResponse, ApiTags, getSchemaPath } from '@nestjs/swagger';
import { ErrorResponseDto } from '../common/api-errors.decorator.js';
import { HealthCheck, HealthCheckService, HealthIndicatorService, TypeOrmHealthIndicator } from '@nestjs/terminus';
import { HoldStore } from '../redis/hold-store.repository.js';

/** One check's result, by dependency name ("postgres", "redis"). */
const CHECKS = (what: string) => ({
  type: 'object',
  description: `${what}, by name ("postgres", "redis"; none for /health/live)`,
  additionalProperties: {
    type: 'object',
    description: "The check's result",
    properties: {
      status: { type: 'string', enum: ['up', 'down'], description: 'up: it answered in time; down: it did not' },
      responseTime: { type: 'integer', description: 'How long the check took, in milliseconds' },
      message: { type: 'string', description: 'Why the check is down (a check that is up has none)' },
    },
    additionalProperties: true,
  },
});

/** The body of a passing check (terminus' report). */
const PASSED = {
  type: 'object',
  properties: {
    status: { type: 'string', enum: ['ok'], description: 'ok: every check passed' },
    info: CHECKS('The checks that passed'),
    error: CHECKS('The checks that failed (none in a 200)'),
    details: CHECKS('Every check'),
  },
  required: ['status', 'info', 'error', 'details'],
};

@ApiTags('operations')
@ApiExtraModels(ErrorResponseDto)
@Controller('health')
export class HealthController {
  constructor(
    private readonly health: HealthCheckService,
    private readonly db: TypeOrmHealthIndicator,
    private readonly indicators: HealthIndicatorService,
    private readonly holds: HoldStore,
  ) {}

  @Get('live')
  @ApiOperation({ summary: 'The process is up (503 once it shuts down)' })
  // Over @HealthCheck's answers: the service answers its 503 with the API's error body (src/common/http-errors.ts).
  @ApiResponse({ status: 200, description: 'The process is up: no dependency is checked', schema: PASSED })
  @ApiResponse({
    status: 503,
    description: 'DEPENDENCY_UNAVAILABLE with `details.dependency` "instance": this instance is shutting down',
    schema: { $ref: getSchemaPath(ErrorResponseDto) },
  })
  @HealthCheck()
  live() {
    return this.health.check([]);
  }

  @Get('ready')
  @ApiOperation({ summary: 'Postgres and Redis answer, and Redis may not evict keys (503 otherwise)' })
  // Over @HealthCheck's answers: the service answers its 503 with the API's error body (src/common/http-errors.ts).
  @ApiResponse({ status: 200, description: 'Postgres and Redis answered', schema: PASSED })
  @ApiResponse({
    status: 503,
    description:
      "DEPENDENCY_UNAVAILABLE; `details.report` is the check's report: `status`, and `info`, `error` and `details` by dependency",
    schema: { $ref: getSchemaPath(ErrorResponseDto) },
  })
  @HealthCheck()
  ready() {
    return this.health.check([
      () => this.db.pingCheck('postgres').withTimeout(1500),
      () =>
        this.indicators
          .check('redis')
          .attempt(() => this.holds.ready())
          .withTimeout(1500),
    ]);
  }
}
